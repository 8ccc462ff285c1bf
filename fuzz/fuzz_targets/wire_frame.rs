//! Frame header, data sub-header and control-message decoding on arbitrary bytes: never panics,
//! and whatever decodes re-encodes to the same header bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tsync::wire::{Control, DataHeader, FrameHeader, FrameKind, HEADER_LEN};

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = FrameHeader::decode(data) {
        assert_eq!(&h.encode()[..], &data[..HEADER_LEN]);
        let body = &data[HEADER_LEN..];
        match h.kind {
            FrameKind::Control => {
                if let Ok(m) = Control::decode(body) {
                    let f = m.to_frame(h.request_id).expect("re-encode");
                    assert!(Control::decode(&f[HEADER_LEN..]).is_ok());
                }
            }
            FrameKind::Data => {
                let _ = DataHeader::decode(body);
            }
        }
    }
    let _ = Control::decode(data);
});
