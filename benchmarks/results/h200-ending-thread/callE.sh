PYTHONPATH=/tmp/pf2 python3 -m pip -q install --no-deps --no-index --target /tmp/pf2 .gpu/fin2/*.whl >/dev/null 2>&1; PYTHONPATH=/tmp/pf2 timeout 300 python3 .gpu/prof_tokens.py 2>&1 | grep -v Warn
