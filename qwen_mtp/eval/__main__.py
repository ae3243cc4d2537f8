"""`python -m qwen_mtp.eval --model qwen-mtp --model_args recipe=... --tasks ...`: lm-eval's own command line,
with the `qwen-mtp` model registered first."""

from __future__ import annotations


def main() -> None:
    from qwen_mtp.errors import MissingExtraError, require_extra

    try:
        require_extra("serve", ("lm_eval",))
    except MissingExtraError as err:
        raise SystemExit(f"error: {err}") from None
    from lm_eval.__main__ import cli_evaluate

    import qwen_mtp.eval.lm  # noqa: F401  (registers the model type)

    cli_evaluate()


if __name__ == "__main__":
    main()
