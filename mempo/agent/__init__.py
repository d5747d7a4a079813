"""The MemPO agent: turn format, generation engines, context builders, rollouts, teacher.

    from mempo.agent.format import build_messages, parse_turn, STOP_SEQUENCES
    from mempo.agent.generation import HFGenerator, OpenAIGenerator, SamplingParams
    from mempo.agent.context import MemoryContext, FullContext
    from mempo.agent.rollout import run_episodes
    from mempo.agent.teacher import ScriptedTeacher

Submodules are imported on use so `import mempo.agent.format` stays light (no torch).
"""
