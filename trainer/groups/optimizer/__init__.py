"""The `optimizer` group (conf/optimizer/): its keys (schema.py), what the framework knows of
optimizer classes (registry.py), the batch rules (scaling.py), the parameter groups (parameters.py)
and the recipe that builds the optimizer (build.py)."""

from trainer.groups.optimizer.schema import OptimizerKeys, validate
from trainer.infra.schema import ConfigGroup

GROUP = ConfigGroup("optimizer", __name__, "the optimizer, its batch-scaling rules and kernel", validate,
                    keys=OptimizerKeys, target=True)
