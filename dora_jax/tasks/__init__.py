"""Tasks: prompt sources and verifiable rewards (plain Python and numpy; no JAX, no models).

- `prompt`: the `Prompt` record and the `PromptSource` / `Tokenizer` interfaces.
- `running_sums`: a synthetic task with long-tailed, verifiable responses for tiny models.
- `sources`: JSONL / Parquet / HF-`datasets` prompt files, shuffled per epoch, resumable.
- `answer_reading`: finding a response's stated answer and reading it as a number.
- `math_answers`: numeric (GSM8K) and symbolic (math-verify) answer grading; its CLI grades a JSONL.
- `reward_pool`: reward functions in worker processes, with per-sample timeouts.
- `task`: `TaskConfig` and the one factory, `make_task`.

Importing this package imports nothing heavy; optional packages (pyarrow, datasets,
math-verify, gcsfs) are imported where they are used.
"""
