"""lm-evaluation-harness adapter: the model type `qwen-mtp` (`lm.py`), registered with lm-eval on import.

lm-eval 0.4.x finds models only in its own registry (no entry-point plugins), so its `lm_eval` command cannot
see ours: `python -m qwen_mtp.eval` is that same command line with `qwen-mtp` registered (docs/serving.md).
"""
