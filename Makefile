# The two commands of the README. `make install` is idempotent; `make test` runs the default suite
# (everything except tests marked slow); `make test-all` includes the slow multi-process matrix.
.PHONY: install test test-all

install:
	bash scripts/install.sh

test:
	bash scripts/test.sh

test-all:
	bash scripts/test.sh --all
