//! Raw C declarations of the PJRT C API, written by hand for this crate.
//!
//! Source of the ABI: XLA's `xla/pjrt/c/pjrt_c_api.h`, API version 0.81 (the version shipped by
//! the `xla-cpu-pjrt` 0.0.1 wheel on PyPI). The header itself is **not** part of this project;
//! the test `tests/integration/pjrt_abi.rs` compiles a C file against the header the Makefile installs and
//! checks `sizeof`, `offsetof` and `*_STRUCT_SIZE` of every struct declared here (generated from
//! [`layout_table`]).
//!
//! Rules that keep these declarations valid against other plugin versions (see
//! `docs/architecture.md`):
//! * structs are append-only in the C API, so a struct declared from 0.81 is a valid prefix of
//!   the same struct in any newer header; plugins accept a caller `struct_size` larger or equal to
//!   their own and reject a smaller one;
//! * every `PJRT_Api` field is guarded by `offset_of!(PJRT_Api, field) < api.struct_size` before
//!   use (see `Plugin::fn_ptr` in `super`), so an older plugin never has a field read past its
//!   table;
//! * C enums are declared as plain integers (`c_int`), never as Rust enums, so an unknown value
//!   written by a newer plugin is not undefined behaviour.
#![allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    missing_docs,
    dead_code
)]

use std::ffi::{c_char, c_int, c_void};

/// Opaque PJRT handle types. Only ever used behind raw pointers.
macro_rules! opaque {
    ($($name:ident),* $(,)?) => {$(
        #[repr(C)]
        pub struct $name { _private: [u8; 0] }
    )*};
}
opaque!(
    PJRT_Error,
    PJRT_Client,
    PJRT_Device,
    PJRT_DeviceDescription,
    PJRT_Memory,
    PJRT_Buffer,
    PJRT_Event,
    PJRT_TopologyDescription,
    PJRT_KeyValueCallbackArgs,
);

/// A PJRT entry point: every function of `PJRT_Api` (except the two error helpers) takes a
/// pointer to its args struct and returns NULL on success or an owned `PJRT_Error*`.
pub type PjrtFn<A> = Option<unsafe extern "C" fn(args: *mut A) -> *mut PJRT_Error>;
/// A `PJRT_Api` slot this crate never calls; declared only to keep the table's layout.
pub type UnusedFn = Option<unsafe extern "C" fn()>;

/// One struct's layout as Rust sees it, for the ABI test.
#[derive(Debug, Clone)]
pub struct StructLayout {
    /// C type name.
    pub name: &'static str,
    /// `size_of` in bytes.
    pub size: usize,
    /// `offset_of + size_of` of the last field: the header's `<name>_STRUCT_SIZE`.
    pub struct_size: usize,
    /// (field name, byte offset) in declaration order.
    pub fields: Vec<(&'static str, usize)>,
}

/// The largest of `ends` (a `const fn` helper of the struct-declaring macro).
#[doc(hidden)]
pub const fn max_end(ends: &[usize]) -> usize {
    let mut m = 0;
    let mut i = 0;
    while i < ends.len() {
        if ends[i] > m {
            m = ends[i];
        }
        i += 1;
    }
    m
}

/// Declares `#[repr(C)]` structs, gives each a `STRUCT_SIZE` constant equal to the header's
/// `PJRT_STRUCT_SIZE(type, last_field)` and records the layout for [`layout_table`].
macro_rules! pjrt_structs {
    ($( pub struct $name:ident { $( pub $field:ident : $ty:ty ),* $(,)? } )*) => {
        $(
            #[repr(C)]
            #[derive(Clone, Copy)]
            pub struct $name { $( pub $field: $ty ),* }
            impl $name {
                /// `offsetof(last field) + sizeof(last field)`, as the header's
                /// `<type>_STRUCT_SIZE` enum constant.
                pub const STRUCT_SIZE: usize =
                    $crate::pjrt::sys::max_end(&[$( ::std::mem::offset_of!($name, $field) + ::std::mem::size_of::<$ty>() ),*]);
                /// A zeroed struct with `struct_size` set: every field is a pointer, an integer,
                /// a bool or an `Option<fn>`, for all of which all-zero bytes are a valid value
                /// (NULL, 0, false, None).
                #[allow(clippy::new_without_default)]
                pub fn new() -> Self {
                    // SAFETY: all fields are plain C data for which the all-zero bit pattern is
                    // valid (see the doc comment above); no references or Rust enums are involved.
                    let mut s: Self = unsafe { std::mem::zeroed() };
                    s.struct_size = Self::STRUCT_SIZE;
                    s
                }
            }
        )*
        /// The layout of every struct declared in this module (for the ABI check test).
        pub fn layout_table() -> Vec<$crate::pjrt::sys::StructLayout> {
            vec![$(
                $crate::pjrt::sys::StructLayout {
                    name: stringify!($name),
                    size: ::std::mem::size_of::<$name>(),
                    struct_size: $name::STRUCT_SIZE,
                    fields: vec![$( (stringify!($field), ::std::mem::offset_of!($name, $field)) ),*],
                }
            ),*]
        }
    };
}
pub(crate) use pjrt_structs;

// C enums (declared as integers; see the module docs).
pub type PJRT_Extension_Type = c_int;
pub const PJRT_Extension_Type_Layouts: c_int = 4;
pub const PJRT_Extension_Type_RawBuffer: c_int = 8;
pub const PJRT_Extension_Type_CrossHostTransfers: c_int = 12;
pub const PJRT_Extension_Type_HostAllocator: c_int = 15;

pub type PJRT_Error_Code = c_int;
pub const PJRT_Error_Code_UNIMPLEMENTED: c_int = 12;

pub type PJRT_NamedValue_Type = c_int;
pub const PJRT_NamedValue_kString: c_int = 0;
pub const PJRT_NamedValue_kInt64: c_int = 1;
pub const PJRT_NamedValue_kInt64List: c_int = 2;
pub const PJRT_NamedValue_kFloat: c_int = 3;
pub const PJRT_NamedValue_kBool: c_int = 4;

pub type PJRT_HostBufferSemantics = c_int;
pub const PJRT_HostBufferSemantics_kImmutableOnlyDuringCall: c_int = 0;
pub const PJRT_HostBufferSemantics_kImmutableUntilTransferCompletes: c_int = 1;
pub const PJRT_HostBufferSemantics_kImmutableZeroCopy: c_int = 2;
pub const PJRT_HostBufferSemantics_kMutableZeroCopy: c_int = 3;

pub type PJRT_Buffer_Type = c_int;
pub const PJRT_Buffer_Type_INVALID: c_int = 0;
pub const PJRT_Buffer_Type_PRED: c_int = 1;
pub const PJRT_Buffer_Type_S8: c_int = 2;
pub const PJRT_Buffer_Type_S16: c_int = 3;
pub const PJRT_Buffer_Type_S32: c_int = 4;
pub const PJRT_Buffer_Type_S64: c_int = 5;
pub const PJRT_Buffer_Type_U8: c_int = 6;
pub const PJRT_Buffer_Type_U16: c_int = 7;
pub const PJRT_Buffer_Type_U32: c_int = 8;
pub const PJRT_Buffer_Type_U64: c_int = 9;
pub const PJRT_Buffer_Type_F16: c_int = 10;
pub const PJRT_Buffer_Type_F32: c_int = 11;
pub const PJRT_Buffer_Type_F64: c_int = 12;
pub const PJRT_Buffer_Type_BF16: c_int = 13;
pub const PJRT_Buffer_Type_F8E5M2: c_int = 16;
pub const PJRT_Buffer_Type_F8E4M3FN: c_int = 17;

pub type PJRT_Buffer_MemoryLayout_Type = c_int;
pub const PJRT_Buffer_MemoryLayout_Type_Tiled: c_int = 0;
pub const PJRT_Buffer_MemoryLayout_Type_Strides: c_int = 1;

/// The anonymous union of `PJRT_NamedValue` (C members `string_value`, `int64_value`,
/// `int64_array_value`, `float_value`, `bool_value`).
#[repr(C)]
#[derive(Clone, Copy)]
pub union PJRT_NamedValue_Value {
    pub string_value: *const c_char,
    pub int64_value: i64,
    pub int64_array_value: *const i64,
    pub float_value: f32,
    pub bool_value: bool,
}

/// The anonymous union of `PJRT_Buffer_MemoryLayout` (C members `tiled`, `strides`).
#[repr(C)]
#[derive(Clone, Copy)]
pub union PJRT_Buffer_MemoryLayout_Union {
    pub tiled: PJRT_Buffer_MemoryLayout_Tiled,
    pub strides: PJRT_Buffer_MemoryLayout_Strides,
}

pub type PJRT_Event_OnReadyCallback =
    Option<unsafe extern "C" fn(error: *mut PJRT_Error, user_arg: *mut c_void)>;
pub type PJRT_OnDeleteCallback =
    Option<unsafe extern "C" fn(device_buffer_ptr: *mut c_void, user_arg: *mut c_void)>;
pub type PJRT_KeyValueCallback =
    Option<unsafe extern "C" fn(args: *mut PJRT_KeyValueCallbackArgs) -> *mut PJRT_Error>;

pjrt_structs! {
    pub struct PJRT_Extension_Base {
        pub struct_size: usize,
        pub r#type: PJRT_Extension_Type,
        pub next: *mut PJRT_Extension_Base,
    }
    pub struct PJRT_Api_Version {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub major_version: c_int,
        pub minor_version: c_int,
    }
    pub struct PJRT_Error_Destroy_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub error: *mut PJRT_Error,
    }
    pub struct PJRT_Error_Message_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub error: *const PJRT_Error,
        pub message: *const c_char,
        pub message_size: usize,
    }
    pub struct PJRT_Error_GetCode_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub error: *const PJRT_Error,
        pub code: PJRT_Error_Code,
    }
    pub struct PJRT_NamedValue {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub name: *const c_char,
        pub name_size: usize,
        pub r#type: PJRT_NamedValue_Type,
        pub value: PJRT_NamedValue_Value,
        pub value_size: usize,
    }
    pub struct PJRT_Plugin_Initialize_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
    }
    pub struct PJRT_Plugin_Attributes_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub attributes: *const PJRT_NamedValue,
        pub num_attributes: usize,
    }
    pub struct PJRT_Event_Destroy_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub event: *mut PJRT_Event,
    }
    pub struct PJRT_Event_IsReady_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub event: *mut PJRT_Event,
        pub is_ready: bool,
    }
    pub struct PJRT_Event_Error_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub event: *mut PJRT_Event,
    }
    pub struct PJRT_Event_Await_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub event: *mut PJRT_Event,
    }
    pub struct PJRT_Event_OnReady_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub event: *mut PJRT_Event,
        pub callback: PJRT_Event_OnReadyCallback,
        pub user_arg: *mut c_void,
    }
    pub struct PJRT_Client_Create_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub create_options: *const PJRT_NamedValue,
        pub num_options: usize,
        pub kv_get_callback: PJRT_KeyValueCallback,
        pub kv_get_user_arg: *mut c_void,
        pub kv_put_callback: PJRT_KeyValueCallback,
        pub kv_put_user_arg: *mut c_void,
        pub client: *mut PJRT_Client,
        pub kv_try_get_callback: PJRT_KeyValueCallback,
        pub kv_try_get_user_arg: *mut c_void,
    }
    pub struct PJRT_Client_Destroy_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub client: *mut PJRT_Client,
    }
    pub struct PJRT_Client_PlatformName_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub client: *mut PJRT_Client,
        pub platform_name: *const c_char,
        pub platform_name_size: usize,
    }
    pub struct PJRT_Client_PlatformVersion_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub client: *mut PJRT_Client,
        pub platform_version: *const c_char,
        pub platform_version_size: usize,
    }
    pub struct PJRT_Client_ProcessIndex_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub client: *mut PJRT_Client,
        pub process_index: c_int,
    }
    pub struct PJRT_Client_Devices_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub client: *mut PJRT_Client,
        pub devices: *const *mut PJRT_Device,
        pub num_devices: usize,
    }
    pub struct PJRT_Client_AddressableDevices_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub client: *mut PJRT_Client,
        pub addressable_devices: *const *mut PJRT_Device,
        pub num_addressable_devices: usize,
    }
    pub struct PJRT_Client_AddressableMemories_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub client: *mut PJRT_Client,
        pub addressable_memories: *const *mut PJRT_Memory,
        pub num_addressable_memories: usize,
    }
    pub struct PJRT_Buffer_MemoryLayout_Tiled {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub minor_to_major: *const i64,
        pub minor_to_major_size: usize,
        pub tile_dims: *const i64,
        pub tile_dim_sizes: *const usize,
        pub num_tiles: usize,
    }
    pub struct PJRT_Buffer_MemoryLayout_Strides {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub byte_strides: *const i64,
        pub num_byte_strides: usize,
    }
    pub struct PJRT_Buffer_MemoryLayout {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub layout: PJRT_Buffer_MemoryLayout_Union,
        pub r#type: PJRT_Buffer_MemoryLayout_Type,
    }
    pub struct PJRT_Client_BufferFromHostBuffer_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub client: *mut PJRT_Client,
        pub data: *const c_void,
        pub r#type: PJRT_Buffer_Type,
        pub dims: *const i64,
        pub num_dims: usize,
        pub byte_strides: *const i64,
        pub num_byte_strides: usize,
        pub host_buffer_semantics: PJRT_HostBufferSemantics,
        pub device: *mut PJRT_Device,
        pub memory: *mut PJRT_Memory,
        pub device_layout: *mut PJRT_Buffer_MemoryLayout,
        pub done_with_host_buffer: *mut PJRT_Event,
        pub buffer: *mut PJRT_Buffer,
    }
    pub struct PJRT_Client_CreateViewOfDeviceBuffer_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub client: *mut PJRT_Client,
        pub device_buffer_ptr: *mut c_void,
        pub dims: *const i64,
        pub num_dims: usize,
        pub element_type: PJRT_Buffer_Type,
        pub layout: *mut PJRT_Buffer_MemoryLayout,
        pub device: *mut PJRT_Device,
        pub on_delete_callback: PJRT_OnDeleteCallback,
        pub on_delete_callback_arg: *mut c_void,
        pub stream: isize,
        pub buffer: *mut PJRT_Buffer,
        pub memory: *mut PJRT_Memory,
    }
    pub struct PJRT_Client_DmaMap_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub client: *mut PJRT_Client,
        pub data: *mut c_void,
        pub size: usize,
    }
    pub struct PJRT_Client_DmaUnmap_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub client: *mut PJRT_Client,
        pub data: *mut c_void,
    }
    pub struct PJRT_Client_CreateUninitializedBuffer_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub client: *mut PJRT_Client,
        pub shape_dims: *const i64,
        pub shape_num_dims: usize,
        pub shape_element_type: PJRT_Buffer_Type,
        pub shape_layout: *mut PJRT_Buffer_MemoryLayout,
        pub device: *mut PJRT_Device,
        pub memory: *mut PJRT_Memory,
        pub buffer: *mut PJRT_Buffer,
    }
    pub struct PJRT_DeviceDescription_Id_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub device_description: *mut PJRT_DeviceDescription,
        pub id: c_int,
    }
    pub struct PJRT_DeviceDescription_ProcessIndex_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub device_description: *mut PJRT_DeviceDescription,
        pub process_index: c_int,
    }
    pub struct PJRT_DeviceDescription_Kind_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub device_description: *mut PJRT_DeviceDescription,
        pub device_kind: *const c_char,
        pub device_kind_size: usize,
    }
    pub struct PJRT_DeviceDescription_ToString_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub device_description: *mut PJRT_DeviceDescription,
        pub to_string: *const c_char,
        pub to_string_size: usize,
    }
    pub struct PJRT_Device_GetDescription_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub device: *mut PJRT_Device,
        pub device_description: *mut PJRT_DeviceDescription,
    }
    pub struct PJRT_Device_IsAddressable_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub device: *mut PJRT_Device,
        pub is_addressable: bool,
    }
    pub struct PJRT_Device_LocalHardwareId_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub device: *mut PJRT_Device,
        pub local_hardware_id: c_int,
    }
    pub struct PJRT_Device_AddressableMemories_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub device: *mut PJRT_Device,
        pub memories: *const *mut PJRT_Memory,
        pub num_memories: usize,
    }
    pub struct PJRT_Device_DefaultMemory_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub device: *mut PJRT_Device,
        pub memory: *mut PJRT_Memory,
    }
    pub struct PJRT_Memory_Id_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub memory: *mut PJRT_Memory,
        pub id: c_int,
    }
    pub struct PJRT_Memory_Kind_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub memory: *mut PJRT_Memory,
        pub kind: *const c_char,
        pub kind_size: usize,
    }
    pub struct PJRT_Memory_Kind_Id_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub memory: *mut PJRT_Memory,
        pub kind_id: c_int,
    }
    pub struct PJRT_Memory_ToString_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub memory: *mut PJRT_Memory,
        pub to_string: *const c_char,
        pub to_string_size: usize,
    }
    pub struct PJRT_Memory_AddressableByDevices_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub memory: *mut PJRT_Memory,
        pub devices: *const *mut PJRT_Device,
        pub num_devices: usize,
    }
    pub struct PJRT_Buffer_Destroy_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
    }
    pub struct PJRT_Buffer_ElementType_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
        pub r#type: PJRT_Buffer_Type,
    }
    pub struct PJRT_Buffer_Dimensions_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
        pub dims: *const i64,
        pub num_dims: usize,
    }
    pub struct PJRT_Buffer_GetMemoryLayout_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
        pub layout: PJRT_Buffer_MemoryLayout,
    }
    pub struct PJRT_Buffer_OnDeviceSizeInBytes_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
        pub on_device_size_in_bytes: usize,
    }
    pub struct PJRT_Buffer_Device_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
        pub device: *mut PJRT_Device,
    }
    pub struct PJRT_Buffer_Memory_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
        pub memory: *mut PJRT_Memory,
    }
    pub struct PJRT_Buffer_Delete_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
    }
    pub struct PJRT_Buffer_IsDeleted_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
        pub is_deleted: bool,
    }
    pub struct PJRT_Buffer_ToHostBuffer_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub src: *mut PJRT_Buffer,
        pub host_layout: *mut PJRT_Buffer_MemoryLayout,
        pub dst: *mut c_void,
        pub dst_size: usize,
        pub event: *mut PJRT_Event,
    }
    pub struct PJRT_Buffer_IsOnCpu_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
        pub is_on_cpu: bool,
    }
    pub struct PJRT_Buffer_ReadyEvent_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
        pub event: *mut PJRT_Event,
    }
    pub struct PJRT_Buffer_UnsafePointer_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
        pub buffer_pointer: usize,
    }
    pub struct PJRT_Buffer_IncreaseExternalReferenceCount_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
    }
    pub struct PJRT_Buffer_DecreaseExternalReferenceCount_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
    }
    pub struct PJRT_Buffer_OpaqueDeviceMemoryDataPointer_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
        pub device_memory_ptr: *mut c_void,
    }
    pub struct PJRT_Buffer_CopyToMemory_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
        pub dst_memory: *mut PJRT_Memory,
        pub dst_buffer: *mut PJRT_Buffer,
    }
    pub struct PJRT_Buffer_CopyRawToHost_Args {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub buffer: *mut PJRT_Buffer,
        pub dst: *mut c_void,
        pub offset: i64,
        pub transfer_size: i64,
        pub event: *mut PJRT_Event,
    }
    pub struct PJRT_Api {
        pub struct_size: usize,
        pub extension_start: *mut PJRT_Extension_Base,
        pub pjrt_api_version: PJRT_Api_Version,
pub PJRT_Error_Destroy: Option<unsafe extern "C" fn(args: *mut PJRT_Error_Destroy_Args)>,
    pub PJRT_Error_Message: Option<unsafe extern "C" fn(args: *mut PJRT_Error_Message_Args)>,
    pub PJRT_Error_GetCode: PjrtFn<PJRT_Error_GetCode_Args>,
    pub PJRT_Plugin_Initialize: PjrtFn<PJRT_Plugin_Initialize_Args>,
    pub PJRT_Plugin_Attributes: PjrtFn<PJRT_Plugin_Attributes_Args>,
    pub PJRT_Event_Destroy: PjrtFn<PJRT_Event_Destroy_Args>,
    pub PJRT_Event_IsReady: PjrtFn<PJRT_Event_IsReady_Args>,
    pub PJRT_Event_Error: PjrtFn<PJRT_Event_Error_Args>,
    pub PJRT_Event_Await: PjrtFn<PJRT_Event_Await_Args>,
    pub PJRT_Event_OnReady: PjrtFn<PJRT_Event_OnReady_Args>,
    pub PJRT_Client_Create: PjrtFn<PJRT_Client_Create_Args>,
    pub PJRT_Client_Destroy: PjrtFn<PJRT_Client_Destroy_Args>,
    pub PJRT_Client_PlatformName: PjrtFn<PJRT_Client_PlatformName_Args>,
    pub PJRT_Client_ProcessIndex: PjrtFn<PJRT_Client_ProcessIndex_Args>,
    pub PJRT_Client_PlatformVersion: PjrtFn<PJRT_Client_PlatformVersion_Args>,
    pub PJRT_Client_Devices: PjrtFn<PJRT_Client_Devices_Args>,
    pub PJRT_Client_AddressableDevices: PjrtFn<PJRT_Client_AddressableDevices_Args>,
    pub PJRT_Client_LookupDevice: UnusedFn,
    pub PJRT_Client_LookupAddressableDevice: UnusedFn,
    pub PJRT_Client_AddressableMemories: PjrtFn<PJRT_Client_AddressableMemories_Args>,
    pub PJRT_Client_Compile: UnusedFn,
    pub PJRT_Client_DefaultDeviceAssignment: UnusedFn,
    pub PJRT_Client_BufferFromHostBuffer: PjrtFn<PJRT_Client_BufferFromHostBuffer_Args>,
    pub PJRT_DeviceDescription_Id: PjrtFn<PJRT_DeviceDescription_Id_Args>,
    pub PJRT_DeviceDescription_ProcessIndex: PjrtFn<PJRT_DeviceDescription_ProcessIndex_Args>,
    pub PJRT_DeviceDescription_Attributes: UnusedFn,
    pub PJRT_DeviceDescription_Kind: PjrtFn<PJRT_DeviceDescription_Kind_Args>,
    pub PJRT_DeviceDescription_DebugString: UnusedFn,
    pub PJRT_DeviceDescription_ToString: PjrtFn<PJRT_DeviceDescription_ToString_Args>,
    pub PJRT_Device_GetDescription: PjrtFn<PJRT_Device_GetDescription_Args>,
    pub PJRT_Device_IsAddressable: PjrtFn<PJRT_Device_IsAddressable_Args>,
    pub PJRT_Device_LocalHardwareId: PjrtFn<PJRT_Device_LocalHardwareId_Args>,
    pub PJRT_Device_AddressableMemories: PjrtFn<PJRT_Device_AddressableMemories_Args>,
    pub PJRT_Device_DefaultMemory: PjrtFn<PJRT_Device_DefaultMemory_Args>,
    pub PJRT_Device_MemoryStats: UnusedFn,
    pub PJRT_Memory_Id: PjrtFn<PJRT_Memory_Id_Args>,
    pub PJRT_Memory_Kind: PjrtFn<PJRT_Memory_Kind_Args>,
    pub PJRT_Memory_DebugString: UnusedFn,
    pub PJRT_Memory_ToString: PjrtFn<PJRT_Memory_ToString_Args>,
    pub PJRT_Memory_AddressableByDevices: PjrtFn<PJRT_Memory_AddressableByDevices_Args>,
    pub PJRT_Executable_Destroy: UnusedFn,
    pub PJRT_Executable_Name: UnusedFn,
    pub PJRT_Executable_NumReplicas: UnusedFn,
    pub PJRT_Executable_NumPartitions: UnusedFn,
    pub PJRT_Executable_NumOutputs: UnusedFn,
    pub PJRT_Executable_SizeOfGeneratedCodeInBytes: UnusedFn,
    pub PJRT_Executable_GetCostAnalysis: UnusedFn,
    pub PJRT_Executable_OutputMemoryKinds: UnusedFn,
    pub PJRT_Executable_OptimizedProgram: UnusedFn,
    pub PJRT_Executable_Serialize: UnusedFn,
    pub PJRT_LoadedExecutable_Destroy: UnusedFn,
    pub PJRT_LoadedExecutable_GetExecutable: UnusedFn,
    pub PJRT_LoadedExecutable_AddressableDevices: UnusedFn,
    pub PJRT_LoadedExecutable_Delete: UnusedFn,
    pub PJRT_LoadedExecutable_IsDeleted: UnusedFn,
    pub PJRT_LoadedExecutable_Execute: UnusedFn,
    pub PJRT_Executable_DeserializeAndLoad: UnusedFn,
    pub PJRT_LoadedExecutable_Fingerprint: UnusedFn,
    pub PJRT_Buffer_Destroy: PjrtFn<PJRT_Buffer_Destroy_Args>,
    pub PJRT_Buffer_ElementType: PjrtFn<PJRT_Buffer_ElementType_Args>,
    pub PJRT_Buffer_Dimensions: PjrtFn<PJRT_Buffer_Dimensions_Args>,
    pub PJRT_Buffer_UnpaddedDimensions: UnusedFn,
    pub PJRT_Buffer_DynamicDimensionIndices: UnusedFn,
    pub PJRT_Buffer_GetMemoryLayout: PjrtFn<PJRT_Buffer_GetMemoryLayout_Args>,
    pub PJRT_Buffer_OnDeviceSizeInBytes: PjrtFn<PJRT_Buffer_OnDeviceSizeInBytes_Args>,
    pub PJRT_Buffer_Device: PjrtFn<PJRT_Buffer_Device_Args>,
    pub PJRT_Buffer_Memory: PjrtFn<PJRT_Buffer_Memory_Args>,
    pub PJRT_Buffer_Delete: PjrtFn<PJRT_Buffer_Delete_Args>,
    pub PJRT_Buffer_IsDeleted: PjrtFn<PJRT_Buffer_IsDeleted_Args>,
    pub PJRT_Buffer_CopyToDevice: UnusedFn,
    pub PJRT_Buffer_ToHostBuffer: PjrtFn<PJRT_Buffer_ToHostBuffer_Args>,
    pub PJRT_Buffer_IsOnCpu: PjrtFn<PJRT_Buffer_IsOnCpu_Args>,
    pub PJRT_Buffer_ReadyEvent: PjrtFn<PJRT_Buffer_ReadyEvent_Args>,
    pub PJRT_Buffer_UnsafePointer: PjrtFn<PJRT_Buffer_UnsafePointer_Args>,
    pub PJRT_Buffer_IncreaseExternalReferenceCount: PjrtFn<PJRT_Buffer_IncreaseExternalReferenceCount_Args>,
    pub PJRT_Buffer_DecreaseExternalReferenceCount: PjrtFn<PJRT_Buffer_DecreaseExternalReferenceCount_Args>,
    pub PJRT_Buffer_OpaqueDeviceMemoryDataPointer: PjrtFn<PJRT_Buffer_OpaqueDeviceMemoryDataPointer_Args>,
    pub PJRT_CopyToDeviceStream_Destroy: UnusedFn,
    pub PJRT_CopyToDeviceStream_AddChunk: UnusedFn,
    pub PJRT_CopyToDeviceStream_TotalBytes: UnusedFn,
    pub PJRT_CopyToDeviceStream_GranuleSize: UnusedFn,
    pub PJRT_CopyToDeviceStream_CurrentBytes: UnusedFn,
    pub PJRT_TopologyDescription_Create: UnusedFn,
    pub PJRT_TopologyDescription_Destroy: UnusedFn,
    pub PJRT_TopologyDescription_PlatformName: UnusedFn,
    pub PJRT_TopologyDescription_PlatformVersion: UnusedFn,
    pub PJRT_TopologyDescription_GetDeviceDescriptions: UnusedFn,
    pub PJRT_TopologyDescription_Serialize: UnusedFn,
    pub PJRT_TopologyDescription_Attributes: UnusedFn,
    pub PJRT_Compile: UnusedFn,
    pub PJRT_Executable_OutputElementTypes: UnusedFn,
    pub PJRT_Executable_OutputDimensions: UnusedFn,
    pub PJRT_Buffer_CopyToMemory: PjrtFn<PJRT_Buffer_CopyToMemory_Args>,
    pub PJRT_Client_CreateViewOfDeviceBuffer: PjrtFn<PJRT_Client_CreateViewOfDeviceBuffer_Args>,
    pub PJRT_Executable_Fingerprint: UnusedFn,
    pub PJRT_Client_TopologyDescription: UnusedFn,
    pub PJRT_Executable_GetCompiledMemoryStats: UnusedFn,
    pub PJRT_Memory_Kind_Id: PjrtFn<PJRT_Memory_Kind_Id_Args>,
    pub PJRT_ExecuteContext_Create: UnusedFn,
    pub PJRT_ExecuteContext_Destroy: UnusedFn,
    pub PJRT_Buffer_CopyRawToHost: PjrtFn<PJRT_Buffer_CopyRawToHost_Args>,
    pub PJRT_AsyncHostToDeviceTransferManager_Destroy: UnusedFn,
    pub PJRT_AsyncHostToDeviceTransferManager_TransferData: UnusedFn,
    pub PJRT_Client_CreateBuffersForAsyncHostToDevice: UnusedFn,
    pub PJRT_AsyncHostToDeviceTransferManager_RetrieveBuffer: UnusedFn,
    pub PJRT_AsyncHostToDeviceTransferManager_Device: UnusedFn,
    pub PJRT_AsyncHostToDeviceTransferManager_BufferCount: UnusedFn,
    pub PJRT_AsyncHostToDeviceTransferManager_BufferSize: UnusedFn,
    pub PJRT_AsyncHostToDeviceTransferManager_SetBufferError: UnusedFn,
    pub PJRT_AsyncHostToDeviceTransferManager_AddMetadata: UnusedFn,
    pub PJRT_Client_DmaMap: PjrtFn<PJRT_Client_DmaMap_Args>,
    pub PJRT_Client_DmaUnmap: PjrtFn<PJRT_Client_DmaUnmap_Args>,
    pub PJRT_Client_CreateUninitializedBuffer: PjrtFn<PJRT_Client_CreateUninitializedBuffer_Args>,
    pub PJRT_Client_UpdateGlobalProcessInfo: UnusedFn,
    pub PJRT_TopologyDescription_Deserialize: UnusedFn,
    pub PJRT_Client_CreateAliasBuffer: UnusedFn,
    pub PJRT_Client_FulfillAliasBuffer: UnusedFn,
    pub PJRT_LoadedExecutable_GetDeviceAssignment: UnusedFn,
    }
}
