"""Train any agent: an OpenAI-compatible gateway on the policy, recording exact tokens per
rollout (``server``), request rendering (``render``) and the trace-to-samples compiler (``trace``)."""

from turnforge.gateway.trace import SPLIT_REASONS, CallRecord, CompiledTrace, Split, compile_trace

__all__ = ["SPLIT_REASONS", "CallRecord", "CompiledTrace", "Split", "compile_trace"]
