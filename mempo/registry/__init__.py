"""The model registry: register a trained policy with its evidence, promote it through a gate.

    mempo register --model-dir outputs/train/model --metrics outputs/eval/metrics.json
    mempo promote --model mempo-agent            # prints the decision as JSON

One module per job (import from them; this package re-exports nothing):

- `gate`: `GateConfig` and the pure `evaluate_gate` (what a challenger must show).
- `evidence`: the metric, headline and eval-set tags a version carries, and how to read them.
- `store`: the MLflow client and the per-model promotion lock.
- `register`: `register_model` (logged model + version, idempotent by registration key).
- `promote`: `promote` (`@challenger`, evidence tags, then `@champion` when the gate passes).
"""
