"""The config groups' implementations that are one module each (data, models and callbacks have
folders of their own): `conf/optimizer/` is optimizer.py (with scaling.py, its batch rules),
`conf/scheduler/` scheduler.py, `conf/precision/` precision.py, `conf/compile/` compile.py,
`conf/checkpointing/` checkpoint.py, `conf/logger/` logger.py, `conf/regularization/`
regularization.py, `conf/trainer/` lightning_trainer.py, `conf/hparams_search/` sweeps.py. A new
group's module goes here."""
