import pytest

from plancache.http import check_url


@pytest.mark.parametrize("url", ["http://", "http://:8787", "https:///v1", "http://host:99999"])
def test_a_server_url_without_a_host_or_with_a_bad_port_is_refused(url):
    with pytest.raises(ValueError, match="server URL"):
        check_url(url)


def test_good_urls_pass():
    assert check_url("http://plancache:8787/") == "http://plancache:8787"
    assert check_url("https://[::1]:443") == "https://[::1]:443"
