//! Frame header, data sub-header and control-message decoding on arbitrary bytes (the handshake
//! messages `Hello`/`HelloAck` and the metadata messages `Describe`/`Description`/`Pull`/`Push`
//! included): never panics, whatever decodes re-encodes to the same header bytes and to a
//! message that decodes again to the same value, and the stripe geometry a decoded `Pull` or
//! `Push` declares is validated and chunked without cost proportional to the declared numbers.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tsync::wire::{Control, DataHeader, FrameHeader, FrameKind, HEADER_LEN};

fn check(m: &Control) {
    let f = m.to_frame(1).expect("re-encode");
    assert_eq!(&Control::decode(&f[HEADER_LEN..]).expect("decode again"), m);
    if let Control::Pull { stripe, total_bytes, .. } | Control::Push { stripe, total_bytes, .. } = m {
        let _ = stripe.validate();
        let _ = stripe.validate_for(*total_bytes);
        for (a, b) in stripe.chunks(*total_bytes).take(16) {
            assert!(a < b && b <= *total_bytes);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = FrameHeader::decode(data) {
        assert_eq!(&h.encode()[..], &data[..HEADER_LEN]);
        let body = &data[HEADER_LEN..];
        match h.kind {
            FrameKind::Control => {
                if let Ok(m) = Control::decode(body) {
                    check(&m);
                }
            }
            FrameKind::Data | FrameKind::DataRef => {
                if let Ok(d) = DataHeader::decode(body) {
                    assert_eq!(&d.encode()[..], &body[..16]);
                }
            }
        }
    }
    if let Ok(m) = Control::decode(data) {
        check(&m);
    }
});
