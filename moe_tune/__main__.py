from moe_tune.cli.train import main

main()
