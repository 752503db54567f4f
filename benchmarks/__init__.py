"""yatt's benchmarks: each prints a table of figures and ratios measured side by side in
one run and writes them to ``DIR/NAME.json`` (``python -m benchmarks NAME [--out DIR]``)."""
