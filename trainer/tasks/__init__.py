"""Task definitions: what a batch is, the loss, the metrics, the unit a batch is counted in and the
FLOPs per unit (`trainer.tasks.protocol.TaskDefinition`). The `task` group (trainer/groups/task.py)
chooses one; the LightningModule (trainer/task.py) drives it; docs/tasks.md explains the protocol."""
