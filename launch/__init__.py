"""gcloud TPU VM launch tooling driven by the experiment config's `pod` section.

`python launch/tpu.py <create|setup|run|logs|ssh|stop|status|delete> --config=configs/X.py [--dry-run]`

Modules: `tpu_types` (the table of accelerator types and zones), `pod` (the `pod` section read and
validated into a `Pod`), `commands` (the gcloud command lines for each action, pure functions of a
`Pod`), `tpu` (the command line and the one place that prints or runs them).
"""
