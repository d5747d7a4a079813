"""The registry's MLflow store: a client on the configured tracking URI, and the per-model lock.

    from mempo.registry.store import mlflow_client, promotion_lock
    with promotion_lock(mlflow_client(), "mempo-agent"):
        ...  # read the champion, move aliases: no other promotion of this model runs meanwhile

The lock is a registered model named `<name>.promotion-lock`, created atomically by the store,
so two racing promotions cannot both read the old champion. Works with any MLflow store:
sqlite (default) or an `mlflow server` URI.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from mempo.errors import MempoError

if TYPE_CHECKING:
    from mlflow import MlflowClient

LOCK_SUFFIX = ".promotion-lock"


def mlflow_client() -> MlflowClient:
    """An `MlflowClient` on the tracking URI `mempo.tracking` configures."""
    from mlflow import MlflowClient

    from mempo.tracking import configure

    return MlflowClient(configure())


@contextmanager
def promotion_lock(
    client: MlflowClient, name: str, *, wait_s: float = 120.0, stale_s: float = 900.0
) -> Iterator[str]:
    """Hold the registry lock of model `name` (a registered model the store creates atomically):
    promotions, and the check-then-create of a registration, of one model run one at a time.

    Waits up to `wait_s` seconds for a holder to finish; a lock older than `stale_s` seconds
    (its holder crashed) is broken. Raises `MempoError` when it cannot be acquired.
    """
    from mlflow.exceptions import MlflowException

    lock_name = name + LOCK_SUFFIX
    token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    deadline = time.monotonic() + wait_s
    delay = 0.05
    while True:
        try:
            client.create_registered_model(
                lock_name, tags={"owner": token, "acquired_at": f"{time.time():.3f}"},
                description=f"lock held while promoting '{name}'; safe to delete if stale",
            )
            break
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                # The sqlite store answers a duplicate create by reading the holder's lock back
                # for its message; the holder released it in between: the lock is free, retry.
                continue
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        try:
            held = client.get_registered_model(lock_name)
            age = time.time() - float(held.tags.get("acquired_at", "0"))
            if age > stale_s:
                # Re-read right before deleting so we break only the lock we judged stale.
                again = client.get_registered_model(lock_name)
                if again.tags.get("owner") == held.tags.get("owner"):
                    client.delete_registered_model(lock_name)
                continue
        except MlflowException:
            continue  # released between our create and get: try again at once
        if time.monotonic() > deadline:
            raise MempoError(
                f"promotion of '{name}' is locked by another process for over {wait_s:.0f} s "
                f"(delete registered model '{lock_name}' if its holder died)"
            )
        time.sleep(delay)
        delay = min(delay * 2, 1.0)
    try:
        yield token
    finally:
        try:
            held = client.get_registered_model(lock_name)
            if held.tags.get("owner") == token:
                client.delete_registered_model(lock_name)
        except MlflowException:
            pass
