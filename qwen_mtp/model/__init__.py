"""Plain-PyTorch Qwen3.5 hybrid model, assembled from a declarative layer plan."""

from qwen_mtp.model.linear import Linear, MergedLinear
from qwen_mtp.model.model import QwenHybridForCausalLM
from qwen_mtp.model.plan import LayerSpec, ModelPlan, plan_model

__all__ = ["LayerSpec", "Linear", "MergedLinear", "ModelPlan", "QwenHybridForCausalLM", "plan_model"]
