"""Accuracy evals (gsm8k few-shot, mgsm_XX zero-shot chat) run against any OpenAI-compatible
HTTP server: `python -m replaylm.eval.run_eval --eval-name gsm8k` (`--help` lists the flags)."""
