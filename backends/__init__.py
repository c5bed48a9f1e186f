"""Code generators and runtimes: the PyTorch reference backend and the Triton generator."""
