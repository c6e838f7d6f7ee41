"""Certificate expiry read from disk."""

from __future__ import annotations

import calendar

import pytest

from appliance.server.tlsinfo import cert_not_after

# openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650
#   -subj /CN=appliance-test   ->   notAfter=Nov 26 09:32:28 2036 GMT
CERT = """-----BEGIN CERTIFICATE-----
MIIBiDCCAS2gAwIBAgIUM7QR0Zm2oEphrrhjBYlgo2nJwXQwCgYIKoZIzj0EAwIw
GTEXMBUGA1UEAwwOYXBwbGlhbmNlLXRlc3QwHhcNMjYxMTI5MDkzMjI4WhcNMzYx
MTI2MDkzMjI4WjAZMRcwFQYDVQQDDA5hcHBsaWFuY2UtdGVzdDBZMBMGByqGSM49
AgEGCCqGSM49AwEHA0IABMN9urq48ie3WRg6nflcjZLLL2Epx/oJQnR7DSG1I31E
bWTmwvFyGO7FOcp8jpX1nNIR/tUXZMmMmsOCruC/O5CjUzBRMB0GA1UdDgQWBBRM
Xtgk9rqiPlp3hapIRFTZIP+csDAfBgNVHSMEGDAWgBRMXtgk9rqiPlp3hapIRFTZ
IP+csDAPBgNVHRMBAf8EBTADAQH/MAoGCCqGSM49BAMCA0kAMEYCIQD1q9pbTHbs
Y2Isy24zizUrWVFaBfn7kQVowgo/sapVLQIhAMNCP3373uf+BePsCs0dRAfB5+eh
bq8zdNqHvYJzZ4oK
-----END CERTIFICATE-----
"""
NOT_AFTER = calendar.timegm((2036, 11, 26, 9, 32, 28))


def test_not_after(tmp_path):
    p = tmp_path / "cert.pem"
    p.write_text(CERT)
    assert cert_not_after(str(p)) == NOT_AFTER


def test_chain_file_reads_the_leaf(tmp_path):
    p = tmp_path / "chain.pem"
    p.write_text(CERT + CERT)
    assert cert_not_after(str(p)) == NOT_AFTER


def test_missing_or_broken_file_raises_oserror(tmp_path):
    with pytest.raises(OSError):
        cert_not_after(str(tmp_path / "absent.pem"))
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    with pytest.raises(OSError):
        cert_not_after(str(bad))
    garbled = tmp_path / "garbled.pem"
    garbled.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    with pytest.raises(ValueError):
        cert_not_after(str(garbled))
