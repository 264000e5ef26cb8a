"""infra/ holds deployment files and one module, wheelhouse.py (`make bench-gpu-wheels`)."""
