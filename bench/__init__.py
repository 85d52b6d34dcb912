"""``mlxpipe bench``: the pipeline's speed beside plain mlx-lm, measured side by side.

One module per mode (``stream``, ``load``, ``prefill``, ``balance``), each
adding its own subcommand; ``common`` holds what they share and ``command``
the command itself. Every configuration is started once and kept up; runs go
round-robin so that a noisy machine slows all of them alike. Figures are
medians; ratios compare configurations measured in the same run.
"""
