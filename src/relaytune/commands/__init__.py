"""One module per CLI command: each owns its argument parser beside the function it calls."""
