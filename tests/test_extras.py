"""``missing_extra``: a missing package of an extra names the pip command; any other missing module stays itself."""

from __future__ import annotations

import pytest

from pdserve.extras import MissingExtra, missing_extra


def test_a_missing_package_of_the_extra_names_the_install_command() -> None:
    with pytest.raises(MissingExtra, match=r"pip install 'pdserve\[k8s\]'") as raised:
        try:
            import kubernetes.no_such_module  # noqa: F401
        except ModuleNotFoundError as error:
            missing_extra(error, "k8s", "the test")
    assert isinstance(raised.value, ModuleNotFoundError)  # code that catches ImportError still does
    assert raised.value.name == "kubernetes.no_such_module"


def test_any_other_missing_module_is_raised_as_it_was() -> None:
    with pytest.raises(ModuleNotFoundError) as raised:
        try:
            import pdserve_no_such_module  # noqa: F401
        except ModuleNotFoundError as error:
            missing_extra(error, "k8s", "the test")
    assert type(raised.value) is ModuleNotFoundError
    assert raised.value.name == "pdserve_no_such_module"
