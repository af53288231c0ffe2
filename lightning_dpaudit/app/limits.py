"""What the `dpaudit` command accepts, shared by its argument parsing (cli.py) and the demo (demo.py)."""

MIN_NOISE_MULTIPLIER = 1e-300  # below it the claimed mu = 1 / noise_multiplier is beyond the float range
