"""Kubeflow Pipelines v2 components, one file per stage.

Each is a lightweight Python component whose `base_image` is the stage's image from
containers/ (which already holds kfp and mempo, hence `install_kfp_package=False`); its body
imports `mempo` and calls the stage's library function. `kfp.local.SubprocessRunner` runs
the very same definitions in the project venv (it ignores `base_image`).

Every component takes `params_file` (params.yaml inside the image, or the checkout locally)
and `overrides` (dotted params keys -> values) and points the stage's paths at its KFP
artifacts, so one params.yaml configures DVC, Airflow and Kubeflow alike.
"""
