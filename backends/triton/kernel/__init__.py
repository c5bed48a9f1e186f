"""Kernels as data: a small statement IR (`ir.py`), one printer to Triton source (`printer.py`), and
the schedules rendered on it (`chunked.py`: the chunk-parallel schedule; `runs.py`: the run-based
tile bodies, printed back to lines for the tile kernels by codegen_runs.py)."""
