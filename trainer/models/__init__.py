"""Networks: one module per `conf/model/*.yaml` choice, built from the layers in `layers`."""
