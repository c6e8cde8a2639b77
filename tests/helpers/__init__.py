"""Code the tests share: tiny models, the reference definitions, the cases several test files run. Imported as `from
helpers.tiny_models import build` (pyproject.toml puts tests/ on the path; a child process or a script such as
distributed_worker.py puts it there itself)."""
