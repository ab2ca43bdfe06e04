from moe_tune.cli import main

main()
