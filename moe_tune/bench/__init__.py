"""The rows of ``moe-tune-bench`` (the command itself: ``moe_tune.cli.bench``); the committed results of its runs
live in the repository's ``benchmarks/``.

  plans.py          the rows a command line asks for (baselines, moe_tune variants, the peer);
  runner.py         runs one row in its own process group lifetime and reads its metrics;
  workload.py       what every row shares, and the comparison of the rows' loss curves;
  baseline.py       the plain Transformers row (with ``peft_baseline.py`` for LoRA, ``trl_baseline.py`` for TRL);
  peer.py           the NeMo AutoModel row;
  report.py         the result's JSON, Markdown table and PNG chart.
"""
