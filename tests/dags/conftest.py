"""Airflow must not touch ~/airflow: every DAG test gets a private AIRFLOW_HOME."""

from __future__ import annotations

import os
import tempfile

# Set before any test module imports airflow (airflow reads these at import).
os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="mempo-airflow-home-"))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "True")
