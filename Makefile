# One command runs every check: `make check`.
.PHONY: check lint typecheck test test-unit docs format bench

check: lint typecheck test

lint:
	ruff check .
	ruff format --check streams tests migrations spark

typecheck:
	mypy

test:
	python -m pytest

# The fast loop for pure work: no servers, seconds.
test-unit:
	python -m pytest tests/unit

docs:
	mkdocs build --strict

format:
	ruff format streams tests migrations spark
	ruff check --fix .

bench:
	streams bench write
