"""``mlxspec bench``: measurement, one module per benchmark.

- :mod:`.prompts`: mlx-lm against mlxspec's engines on prompt sets (a loaded model);
- :mod:`.fim`: the ``fim`` prompt set, fill-in-the-middle spans cut from mlxspec's own source;
- :mod:`.sweep`: the cost of a forward of 1..N tokens (``--sweep``);
- :mod:`.chat`: time to first token over a growing chat, with and without prefix reuse (``--chat``);
- :mod:`.real_shapes` and :mod:`.script`: the engines on scripted random-weight models of real
  shapes (``--real-shapes``);
- :mod:`.synthetic`: those random-weight models;
- :mod:`.report`: the JSON documents, tables and charts of them all.
"""
