"""The simulator and the page pool stay jax-free: `tidejax.serving` loads names lazily."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["tidejax.sim", "tidejax.serving.page_pool", "tidejax.serving"])
def test_import_leaves_jax_out(module):
    code = f"import sys, {module}; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", f"importing {module} pulled in jax"


def test_serving_names_resolve_lazily():
    code = (
        "import sys, tidejax.serving as s; "
        "assert 'tidejax.serving.engine' not in sys.modules; "
        "assert s.PagePool.__module__ == 'tidejax.serving.page_pool'; "
        "assert 'jax' not in sys.modules; "
        "assert s.PoolFull is __import__('tidejax.serving.page_pool', fromlist=['x']).PoolFull; "
        "assert sorted(s.__all__) == sorted(s._WHERE); "
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_unknown_serving_name_is_an_attribute_error():
    import tidejax.serving as s

    with pytest.raises(AttributeError):
        s.NoSuchThing  # noqa: B018
