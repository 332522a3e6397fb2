"""Data modules: one per `conf/data/*.yaml` choice, all sharing the loader rules of `base`."""
