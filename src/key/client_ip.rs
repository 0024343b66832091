//! The client address, believing forwarding headers only from trusted proxies.

use std::net::IpAddr;

use http::HeaderMap;
use ipnet::IpNet;

fn trusted(ip: IpAddr, nets: &[IpNet]) -> bool {
    nets.iter().any(|n| n.contains(&ip))
}

/// Whether `peer` (the socket's) is a trusted proxy, whose headers are believed.
#[inline]
pub fn peer_trusted(peer: IpAddr, trusted_proxies: &[IpNet]) -> bool {
    !trusted_proxies.is_empty() && trusted(peer.to_canonical(), trusted_proxies)
}

/// The address a request is keyed by. `peer` is the socket peer.
///
/// Only when `peer` is trusted are `X-Forwarded-For` entries (or, without that header,
/// `Forwarded: for=`) considered: right to left, trusted hops are skipped and the first
/// untrusted address is the client. An unparsable entry ends the walk at the last good hop,
/// so garbage cannot pick an address. If every hop is trusted the leftmost one is the client.
pub fn client_ip(peer: IpAddr, headers: &HeaderMap, trusted_proxies: &[IpNet]) -> IpAddr {
    let peer = peer.to_canonical();
    if trusted_proxies.is_empty() || !trusted(peer, trusted_proxies) {
        return peer;
    }
    let mut hops: Vec<&str> = Vec::new();
    for v in headers.get_all("x-forwarded-for") {
        let Ok(s) = v.to_str() else { return peer };
        hops.extend(s.split(',').map(str::trim).filter(|s| !s.is_empty()));
    }
    if hops.is_empty() {
        for v in headers.get_all("forwarded") {
            let Ok(s) = v.to_str() else { return peer };
            for element in s.split(',') {
                for pair in element.split(';') {
                    let Some((k, v)) = pair.trim().split_once('=') else {
                        continue;
                    };
                    if k.trim().eq_ignore_ascii_case("for") {
                        hops.push(v.trim());
                    }
                }
            }
        }
    }
    let mut client = peer;
    for hop in hops.iter().rev() {
        match parse_hop(hop) {
            Some(ip) => {
                client = ip;
                if !trusted(ip, trusted_proxies) {
                    return ip;
                }
            }
            None => return client,
        }
    }
    client
}

/// `1.2.3.4`, `1.2.3.4:80`, `2001:db8::1`, `[2001:db8::1]:80`, and their quoted forms.
fn parse_hop(s: &str) -> Option<IpAddr> {
    let s = s.trim_matches('"');
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip.to_canonical());
    }
    if let Some(rest) = s.strip_prefix('[') {
        let end = rest.find(']')?;
        return rest[..end]
            .parse::<IpAddr>()
            .ok()
            .map(|ip| ip.to_canonical());
    }
    let (host, port) = s.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    host.parse::<std::net::Ipv4Addr>().ok().map(IpAddr::V4)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn nets(s: &[&str]) -> Vec<IpNet> {
        s.iter().map(|n| n.parse().unwrap()).collect()
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn untrusted_peer_is_the_client_whatever_it_claims() {
        let h = headers(&[("x-forwarded-for", "1.1.1.1")]);
        let ip = client_ip("9.9.9.9".parse().unwrap(), &h, &nets(&["10.0.0.0/8"]));
        assert_eq!(ip, "9.9.9.9".parse::<IpAddr>().unwrap());
        let ip = client_ip("10.0.0.1".parse().unwrap(), &h, &[]);
        assert_eq!(ip, "10.0.0.1".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn walks_right_to_left_skipping_trusted_hops() {
        // A client spoofing 6.6.6.6 in front of its real address 2.2.2.2, through two proxies.
        let h = headers(&[
            ("x-forwarded-for", "6.6.6.6, 2.2.2.2"),
            ("x-forwarded-for", "10.0.0.5"),
        ]);
        let ip = client_ip("10.0.0.1".parse().unwrap(), &h, &nets(&["10.0.0.0/8"]));
        assert_eq!(ip, "2.2.2.2".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn forwarded_header_and_ports() {
        let h = headers(&[(
            "forwarded",
            "for=\"[2001:db8::7]:4711\";proto=http, for=10.0.0.9",
        )]);
        let ip = client_ip("10.0.0.1".parse().unwrap(), &h, &nets(&["10.0.0.0/8"]));
        assert_eq!(ip, "2001:db8::7".parse::<IpAddr>().unwrap());
        let h = headers(&[("x-forwarded-for", "3.3.3.3:5555")]);
        let ip = client_ip("10.0.0.1".parse().unwrap(), &h, &nets(&["10.0.0.0/8"]));
        assert_eq!(ip, "3.3.3.3".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn garbage_stops_at_the_last_good_hop() {
        let h = headers(&[("x-forwarded-for", "1.1.1.1, not-an-ip, 10.0.0.7")]);
        let ip = client_ip("10.0.0.1".parse().unwrap(), &h, &nets(&["10.0.0.0/8"]));
        assert_eq!(ip, "10.0.0.7".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn all_trusted_gives_the_leftmost_and_mapped_v6_is_canonical() {
        let h = headers(&[("x-forwarded-for", "10.0.0.3, 10.0.0.2")]);
        let ip = client_ip(
            "::ffff:10.0.0.1".parse().unwrap(),
            &h,
            &nets(&["10.0.0.0/8"]),
        );
        assert_eq!(ip, "10.0.0.3".parse::<IpAddr>().unwrap());
    }
}
