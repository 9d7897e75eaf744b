//! The one shape of a `Debug` that names every field of a struct, some of them masked or
//! summed up (a URL's password, a list of secrets): the struct is destructured, so a field
//! added later fails to compile until it is listed.

/// Writes `impl Debug for $ty`, listing each field in order: `field` shows as itself,
/// `field => expr` shows as `expr` (which reads the field by its name).
macro_rules! debug_fields {
    ($ty:ident { $($field:ident $(=> $shown:expr)?),* $(,)? }) => {
        impl std::fmt::Debug for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                let Self { $($field),* } = self;
                f.debug_struct(stringify!($ty))
                    $(.field(
                        stringify!($field),
                        $crate::debug_fields::debug_fields!(@shown $field $(, $shown)?),
                    ))*
                    .finish()
            }
        }
    };
    (@shown $field:ident) => { $field };
    (@shown $field:ident, $shown:expr) => { &$shown };
}
pub(crate) use debug_fields;
