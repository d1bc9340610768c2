# One command runs every check: `make check`.
.PHONY: check lint typecheck test format bench

check: lint typecheck test

lint:
	ruff check .
	ruff format --check streams tests migrations spark

typecheck:
	mypy

test:
	python -m pytest

format:
	ruff format streams tests migrations spark
	ruff check --fix .

bench:
	streams bench write
