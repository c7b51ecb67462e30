"""Data-parallel gradient communication: a ppermute ring all-reduce with a codec on every hop,
gradient codecs (``codecs/``), aggregators by codec name (``aggregate``), Pipe-SGD
(``pipesgd``), the alpha-beta cluster timing model (``timing``) and ``study`` (the compressed
all-reduce experiment end to end, what ``experiments.compress`` runs)."""
