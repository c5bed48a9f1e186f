"""Kernels as data: a small statement IR (`ir.py`), one printer to Triton source (`printer.py`), and
the schedules rendered on it (`chunked.py`: the chunk-parallel schedule; `runs.py`: the run-based
tile bodies; `lanes.py` / `lanes_adjoint.py`: the lane-sequential schedule; codegen_tile.py the tile
kernels), with the statement builders they share (`builders.py`) and the small shared kernels
(`common.py`)."""
