# Sourced by scripts/gpu_check.sh (and by tests/scripts/test_gpu_check.py, which checks
# the verdicts below on test files of its own). Needs: PY, DRY_RUN, $out, and add().

# Tests that are meant to skip where a GPU is present say so in their skip reason with
# this tag (tests/executor/test_device.py: the choices a machine without CUDA makes).
# Any other skip in a GPU check means a test that should have run did not (a missing GPU
# dependency, a kernel not built): a failure.
GPU_SKIP_TAG="CPU-only:"

# pytest_check NAME LIMIT_S FILE...: PASS when every test passed and none skipped except
# those tagged $GPU_SKIP_TAG (counted in the figure).
pytest_check() {
    local name=$1 limit=$2 log="$out/pytest.txt"
    shift 2
    if [ "$DRY_RUN" = 1 ]; then add "$name" SKIP "dry run"; return; fi
    if timeout "$limit" "$PY" -m pytest -q -rs -p no:cacheprovider "$@" >"$log" 2>&1; then
        local skips stated unstated
        skips=$(grep '^SKIPPED' "$log" || true)
        stated=$(printf '%s' "$skips" | grep -c -F "$GPU_SKIP_TAG" || true)
        unstated=$(printf '%s' "$skips" | grep -v -c -F "$GPU_SKIP_TAG" || true)
        if [ "$unstated" -gt 0 ]; then
            tail -n 20 "$log"
            add "$name" FAIL "tests skipped: $unstated ($(printf '%s\n' "$skips" \
                | grep -v -F "$GPU_SKIP_TAG" | head -n 1 | sed 's/^SKIPPED \[[0-9]*\] //'))"
        else
            add "$name" PASS "$(tail -n 1 "$log" | tr -d '=' | sed 's/^ *//')$(
                [ "$stated" -gt 0 ] && echo "; $stated meant to skip on a GPU")"
        fi
    else
        local code=$?
        tail -n 40 "$log"
        add "$name" FAIL "exit status $code$([ "$code" = 124 ] && echo ", over ${limit} s")"
    fi
}
