//! RDMA NICs of this host (feature `rdma`, through the `ibverbs` crate): each device's ports,
//! their state, link layer and rate, logged at init and available to the cost model. There is no
//! RDMA data path: no machine here has an RDMA device to test one on.

/// One port of an RDMA device.
#[derive(Clone, Debug, PartialEq)]
pub struct Port {
    pub device: String,
    pub port: u8,
    pub active: bool,
    /// "InfiniBand" or "Ethernet" (RoCE).
    pub link_layer: &'static str,
    /// Signalling rate: lanes × per-lane rate.
    pub gbps: f64,
}

/// A port's rate from `ibv_port_attr`'s `active_width` (lanes) and `active_speed` (per-lane
/// rate) codes, as `ibv_query_port(3)` lists them; 0 for codes it does not list.
pub fn port_gbps(active_width: u8, active_speed: u8) -> f64 {
    let lanes = match active_width {
        1 => 1.0,
        2 => 4.0,
        4 => 8.0,
        8 => 12.0,
        16 => 2.0,
        _ => 0.0,
    };
    let per_lane = match active_speed {
        1 => 2.5,
        2 => 5.0,
        4 | 8 => 10.0,
        16 => 14.0,
        32 => 25.0,
        64 => 50.0,
        128 => 100.0,
        _ => 0.0,
    };
    lanes * per_lane
}

/// The RDMA ports of this host, or why there are none.
#[cfg(feature = "rdma")]
pub fn discover() -> Result<Vec<Port>, String> {
    use ibverbs_sys as ffi;
    let list = ibverbs::devices().map_err(|e| format!("no RDMA devices ({e})"))?;
    if list.is_empty() {
        return Err("no RDMA devices".into());
    }
    drop(list);
    let mut ports = Vec::new();
    let mut n: std::os::raw::c_int = 0;
    // SAFETY: n is a valid out-parameter; the list is freed below.
    let devices = unsafe { ffi::ibv_get_device_list(&mut n) };
    if devices.is_null() {
        return Err("no RDMA devices (the device list could not be read)".into());
    }
    for i in 0..n.max(0) as usize {
        // SAFETY: i < n entries of the list returned above.
        let dev = unsafe { *devices.add(i) };
        // SAFETY: dev is a device of the list; the name is a NUL-terminated string it owns.
        let name = unsafe { std::ffi::CStr::from_ptr(ffi::ibv_get_device_name(dev)) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: dev is a device of the list; the context is closed below.
        let ctx = unsafe { ffi::ibv_open_device(dev) };
        if ctx.is_null() {
            continue;
        }
        // SAFETY: zeroed is a valid initial value of these plain C structs.
        let mut attr: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: ctx is an open context and attr a valid out-parameter.
        if unsafe { ffi::ibv_query_device(ctx, &mut attr) } == 0 {
            for port in 1..=attr.phys_port_cnt {
                // SAFETY: as above.
                let mut pa: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
                // SAFETY: ctx is open, port within the device's port count, pa valid.
                if unsafe { ffi::ibv_query_port(ctx, port, &mut pa as *mut _ as *mut _) } != 0 {
                    continue;
                }
                ports.push(Port {
                    device: name.clone(),
                    port,
                    active: pa.state == ffi::ibv_port_state::IBV_PORT_ACTIVE,
                    link_layer: if pa.link_layer == 2 {
                        "Ethernet"
                    } else {
                        "InfiniBand"
                    },
                    gbps: port_gbps(pa.active_width, pa.active_speed),
                });
            }
        }
        // SAFETY: ctx was opened above and is not used after this.
        unsafe { ffi::ibv_close_device(ctx) };
    }
    // SAFETY: the list from ibv_get_device_list, no device of it used after this.
    unsafe { ffi::ibv_free_device_list(devices) };
    if ports.is_empty() {
        return Err("no RDMA ports".into());
    }
    Ok(ports)
}

/// The RDMA ports of this host, or why there are none.
#[cfg(not(feature = "rdma"))]
pub fn discover() -> Result<Vec<Port>, String> {
    Err("built without RDMA discovery (cargo feature rdma)".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_from_the_port_codes() {
        assert_eq!(port_gbps(2, 32), 100.0); // 4x EDR
        assert_eq!(port_gbps(2, 64), 200.0); // 4x HDR
        assert_eq!(port_gbps(2, 128), 400.0); // 4x NDR
        assert_eq!(port_gbps(1, 1), 2.5);
        assert_eq!(port_gbps(3, 32), 0.0);
    }

    #[test]
    fn discovery_names_its_devices_or_says_why_there_are_none() {
        match discover() {
            Ok(ports) => assert!(ports.iter().all(|p| !p.device.is_empty())),
            Err(why) => assert!(
                why.starts_with("no RDMA")
                    || (!cfg!(feature = "rdma") && why.starts_with("built without RDMA")),
                "{why}"
            ),
        }
    }
}
