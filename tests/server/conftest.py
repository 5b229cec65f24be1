"""tests/server mirrors server/: one folder per room. This file puts tests/server on sys.path (pytest
does so for a conftest's folder) so that every folder's tests import the shared fixtures here
(``service_support``: servers on loopback, metrics scraping, reference results)."""
