"""An example kilolayer plug-in package: a residual scheme (``gpt2_pre_ln``) and a data source (``repeat``),
declared as entry points in its ``pyproject.toml``; kilolayer loads them when a config names them."""
