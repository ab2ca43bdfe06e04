"""Everything about the parallel layout, as torchtitan's ``distributed/``:

  dims.py                   ``ParallelDims``: the layout resolved and checked from the config (no torch);
  process_group.py          rank and world from torchrun or Slurm, ``init_distributed``;
  mesh.py                   ``ParallelMesh``: the device meshes and process groups of a layout;
  expert_parallel.py        the token dispatchers of the expert-parallel group (set at model construction);
  activation_checkpoint.py, compile.py, fsdp.py   applied to a built model by ``parallelize.parallelize``;
  clip.py                   the global gradient norm over every mesh, and clipping.

This ``__init__`` imports nothing, so that ``moe_tune.config`` can read ``dims`` without torch; import the modules.
"""
