"""Evaluation: benchmarks x agents (MemPO memory, full context, external memory, one-shot RAG,
direct answer), per-sample and aggregate metrics, plots, report, MLflow logging, `mempo ask`.

    mempo eval --model outputs/train/final --benchmarks world world-k4 --out outputs/eval
    mempo ask "Who is the mayor of the city where X was born?" --model outputs/train/final

Library entry points: `mempo.evaluation.runner.run_eval` (the stage),
`mempo.evaluation.agent_runner.evaluate_items` (agents x benchmarks -> sample rows, in
process) and `mempo.evaluation.ask.ask`.
Submodules are imported on use, so importing this package stays light.
"""
