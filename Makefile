# Two entry points: `make demo` (compile + run the tiny example) and `make test`.
PY      := .venv/bin/python
VENV    := .venv/.installed
LOCK    := constraints.txt
# The versions the suite last passed with (docs/dependencies.md); `make UNLOCKED=1 test` installs the newest
# releases within pyproject.toml's ranges instead, the first step of moving the lock forward.
PIN     := $(if $(UNLOCKED),,-c $(LOCK))

.PHONY: demo test lint lock clean

$(VENV): pyproject.toml $(LOCK)
	test -d .venv || python3 -m venv .venv
	$(PY) -m pip install -q $(PIN) torch==2.13.0
	$(PY) -m pip install -q $(PIN) -e '.[dev,hf,fp8]'
	DS_BUILD_OPS=0 $(PY) -m pip install -q $(PIN) deepspeed  # only its config parser is used (tests)
	touch $(VENV)

demo: $(VENV)
	.venv/bin/zplan compile gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200 --gpus 1024 \
	  --cluster dgx-a100-80g --global-batch 1536 -o out/gpt175b
	.venv/bin/zplan compile examples/tiny.py --gpus 2 --cluster cpu-local --global-batch 8 --seq 64 \
	  --precision fp32 -o out/tiny
	PATH="$(CURDIR)/.venv/bin:$$PATH" bash out/tiny/launch/torchrun.sh --steps 300 --lr 3e-3 \
	  --save-weights out/tiny/weights.pt
	.venv/bin/zplan compile gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200 --mode inference \
	  --gpus 8 --cluster dgx-h200 -o out/gpt175b-serve
	.venv/bin/zplan compile examples/tiny.py --mode inference --gpus 1 --cluster cpu-local -o out/tiny-serve
	printf 'abcdefghij\nACEGIK\n' | PATH="$(CURDIR)/.venv/bin:$$PATH" bash out/tiny-serve/launch/generate.sh \
	  --weights out/tiny/weights.pt --max-new-tokens 12

test: $(VENV)
	.venv/bin/ruff check .
	$(PY) -m pytest -q -n 2 tests

lint: $(VENV)
	.venv/bin/ruff check .

# Write the lock from .venv: run only after `make test` passed on it (docs/dependencies.md).
lock:
	{ sed -n '/^#/p' $(LOCK); $(PY) -m pip freeze --exclude-editable | sed 's/^torch==\([^+]*\)+cpu$$/torch==\1/'; } \
	  > $(LOCK).new && mv $(LOCK).new $(LOCK)

clean:
	rm -rf out build *.egg-info
