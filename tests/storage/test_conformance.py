"""The backend contract, checked the same way on every backend (fsspec ``tests/abstract`` style):
the mixins of ``tardigrade.testing.conformance``, which users run on their own backends too,
here on a local directory, ``memory://``, S3 and fsspec (``conftest.py``'s fixtures).
"""

from __future__ import annotations

from tardigrade.testing import conformance


class TestBytes(conformance.BytesContract):
    pass


class TestCommit(conformance.CommitContract):
    pass


class TestLease(conformance.LeaseContract):
    pass


class TestTidy(conformance.TidyContract):
    pass


class TestStoreTidy(conformance.StoreTidyContract):
    pass
