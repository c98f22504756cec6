//! The address a rank gives the others to reach it (its rendezvous under torchrun, its gloo
//! listener): the interface that routes to the master, unless that is a loopback address in a
//! job of several nodes. The master's own host often resolves its name to a loopback address
//! (Debian's `127.0.1.1` line in `/etc/hosts`), and ranks on other nodes cannot dial that.

use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, UdpSocket};

use anyhow::{bail, Context, Result};

/// A network interface's name and one of its addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InterfaceAddress {
    pub name: String,
    pub address: IpAddr,
}

/// Picks the advertised address: `socket_ifname`'s (`GLOO_SOCKET_IFNAME`, as PyTorch's gloo
/// reads it) when given; else `route` (this host's end of the route to the master) unless it is
/// a loopback address and the job spans several nodes, in which case the first interface that
/// is not a loopback. A host with no such interface keeps the loopback: no other node can reach
/// it anyway.
pub fn choose_address(
    route: IpAddr,
    nodes: usize,
    socket_ifname: Option<&str>,
    interfaces: &[InterfaceAddress],
) -> Result<IpAddr> {
    if let Some(name) = socket_ifname {
        let found = interfaces
            .iter()
            .filter(|i| i.name == name)
            .min_by_key(|i| i.address.is_ipv6());
        return match found {
            Some(interface) => Ok(interface.address),
            None => bail!(
                "$GLOO_SOCKET_IFNAME={name:?} names no interface with an address on this host \
                 (interfaces: {})",
                interface_names(interfaces)
            ),
        };
    }
    if !route.is_loopback() || nodes <= 1 {
        return Ok(route);
    }
    Ok(interfaces
        .iter()
        .filter(|i| !i.address.is_loopback() && !is_link_local(i.address))
        .min_by_key(|i| i.address.is_ipv6())
        .map_or(route, |i| i.address))
}

fn is_link_local(address: IpAddr) -> bool {
    match address {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

fn interface_names(interfaces: &[InterfaceAddress]) -> String {
    let mut names: Vec<&str> = interfaces.iter().map(|i| i.name.as_str()).collect();
    names.dedup();
    names.join(", ")
}

/// This host's end of the route to `master` (`host:port`); no packet is sent.
pub fn route_to(master: &str) -> Result<IpAddr> {
    let probe = UdpSocket::bind("0.0.0.0:0")?;
    probe
        .connect(master)
        .with_context(|| format!("no route to the master at {master}"))?;
    Ok(probe.local_addr()?.ip())
}

/// The addresses of this host's interfaces that are up.
pub fn interfaces() -> Result<Vec<InterfaceAddress>> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a linked list freed below by freeifaddrs.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Err(std::io::Error::last_os_error()).context("listing the network interfaces");
    }
    let mut found = Vec::new();
    let mut entry = list;
    while !entry.is_null() {
        // SAFETY: `entry` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*entry };
        entry = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_flags & libc::IFF_UP as libc::c_uint == 0 {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string; ifa_addr points to a sockaddr whose
        // family says which sockaddr_* it is.
        let (name, address) = unsafe {
            let name = CStr::from_ptr(ifa.ifa_name).to_string_lossy().into_owned();
            let address = match (*ifa.ifa_addr).sa_family as libc::c_int {
                libc::AF_INET => {
                    let v4 = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    IpAddr::V4(Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr)))
                }
                libc::AF_INET6 => {
                    let v6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    IpAddr::V6(Ipv6Addr::from(v6.sin6_addr.s6_addr))
                }
                _ => continue,
            };
            (name, address)
        };
        found.push(InterfaceAddress { name, address });
    }
    // SAFETY: `list` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(list) };
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn interface(name: &str, address: &str) -> InterfaceAddress {
        InterfaceAddress {
            name: name.into(),
            address: address.parse().unwrap(),
        }
    }

    fn host() -> Vec<InterfaceAddress> {
        vec![
            interface("lo", "127.0.0.1"),
            interface("lo", "::1"),
            interface("eth0", "fe80::1"),
            interface("eth0", "10.1.2.3"),
            interface("ib0", "192.168.7.3"),
        ]
    }

    #[test]
    fn the_route_to_the_master_is_kept_unless_it_is_loopback_across_nodes() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(
            choose_address(ip("10.1.2.3"), 2, None, &host()).unwrap(),
            ip("10.1.2.3")
        );
        // One node: every rank dials the loopback.
        assert_eq!(
            choose_address(ip("127.0.0.1"), 1, None, &host()).unwrap(),
            ip("127.0.0.1")
        );
        // The master's node in a job of two: the others must be able to dial it.
        assert_eq!(
            choose_address(ip("127.0.0.1"), 2, None, &host()).unwrap(),
            ip("10.1.2.3")
        );
        let isolated = [interface("lo", "127.0.0.1")];
        assert_eq!(
            choose_address(ip("127.0.0.1"), 2, None, &isolated).unwrap(),
            ip("127.0.0.1")
        );
    }

    #[test]
    fn gloo_socket_ifname_picks_the_interface() {
        let route = "10.1.2.3".parse().unwrap();
        assert_eq!(
            choose_address(route, 2, Some("ib0"), &host()).unwrap(),
            "192.168.7.3".parse::<IpAddr>().unwrap()
        );
        let error = choose_address(route, 2, Some("ib9"), &host()).unwrap_err();
        let message = format!("{error:#}");
        assert!(
            message.contains("GLOO_SOCKET_IFNAME=\"ib9\"") && message.contains("lo, eth0, ib0"),
            "{message}"
        );
    }

    #[test]
    fn this_host_has_a_loopback_interface() {
        let found = interfaces().unwrap();
        assert!(found.iter().any(|i| i.address.is_loopback()), "{found:?}");
    }
}
