# One command runs every check: `make check`.
.PHONY: check lint typecheck test format bench

check: lint typecheck test

lint:
	ruff check .
	ruff format --check .

typecheck:
	mypy

test:
	python -m pytest

format:
	ruff format .
	ruff check --fix .

bench:
	streams bench write
