"""Diagnosing depth.

* :mod:`kilolayer.analysis.smoothness`: over-smoothing metrics, the layer-by-layer
  observer and ``smoothness(model, batches)``;
* :mod:`kilolayer.analysis.hf`: Hugging Face model directories as subjects;
* :mod:`kilolayer.analysis.stability`: DeepNet's diagnostics read from ``metrics.jsonl``;
* :mod:`kilolayer.analysis.plots`: their figures; :mod:`kilolayer.analysis.cli`: ``kilolayer analyze``.
"""
