# The two commands of the README. Each first runs scripts/setup.sh (idempotent).
.PHONY: up test setup filter

up:
	@PY=$$(scripts/setup.sh) && exec "$$PY" -m infermesh.cli up

test:
	@scripts/test.sh

setup:
	@scripts/setup.sh >/dev/null

filter:
	@scripts/build-filter.sh
