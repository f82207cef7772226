//! The kernels' by-value structs, read from their CUDA source (tests only).
//!
//! Why: a `#[repr(C)]` struct handed to a kernel (`Lay`, `MmBatch`, `FgSeg`, `FgSet`, the copy
//! batch) must match its CUDA twin field for field, or the kernel reads garbage without any
//! error. A test that computes the expected size from the Rust side (its own constants, a field
//! count written down by hand) proves nothing about the CUDA side; these helpers read the
//! other side of the contract — the `.cu` text the kernels are compiled from.
//!
//! Strategy: a small reader for the C subset those structs use: scalar fields (`i64`, `u64`,
//! `double`, `u32`, `int`, `float`, `u16`, `unsigned char`), arrays whose bounds are literals
//! or `#define`d names, structs of the same source as field types, `__align__(N)`; natural C
//! alignment. The field names, in order, are compared with the Rust struct's `Debug` output
//! (which lists its fields in declaration order), the size and alignment with `size_of` and
//! `align_of`, the `#define`d bounds with the Rust constants.
//!
//! Invariant: a struct the reader cannot parse fails the test that asked for it (a panic that
//! names the struct), never a silent pass.

/// One field of a CUDA struct: its name, byte offset and size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Field {
    pub name: String,
    pub offset: usize,
    pub size: usize,
}

/// The layout of a CUDA struct.
#[derive(Clone, Debug)]
pub(crate) struct CStruct {
    pub fields: Vec<Field>,
    pub size: usize,
    pub align: usize,
}

impl CStruct {
    /// The field names in declaration order.
    pub fn names(&self) -> Vec<String> {
        self.fields.iter().map(|f| f.name.clone()).collect()
    }
}

/// The value of `#define NAME value` in `src` (a decimal literal).
pub(crate) fn c_define(src: &str, name: &str) -> usize {
    src.lines()
        .filter_map(|l| l.trim().strip_prefix("#define "))
        .find_map(|l| {
            let mut it = l.split_whitespace();
            (it.next() == Some(name)).then(|| it.next().map(str::to_string))?
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no `#define {name} <number>` in the source"))
}

/// The top-level field names of a struct printed with `{:?}` (`Name { a: .., b: [..] }`).
pub(crate) fn debug_fields(debug: &str) -> Vec<String> {
    let body = debug
        .split_once('{')
        .map(|(_, b)| b)
        .unwrap_or_else(|| panic!("not a struct's Debug output: {debug}"));
    let mut names = Vec::new();
    let (mut depth, mut token, mut at_name) = (0usize, String::new(), true);
    for ch in body.chars() {
        match ch {
            '{' | '[' | '(' => depth += 1,
            '}' | ']' | ')' => depth = depth.saturating_sub(1),
            ':' if depth == 0 && at_name => {
                names.push(token.trim().to_string());
                at_name = false;
            }
            ',' if depth == 0 => {
                token.clear();
                at_name = true;
                continue;
            }
            _ => {}
        }
        if at_name && depth == 0 && ch != ':' {
            token.push(ch);
        }
    }
    names
}

fn strip_comments(src: &str) -> String {
    src.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

fn scalar(ty: &str) -> Option<usize> {
    Some(match ty {
        "i64" | "u64" | "double" | "long long" | "unsigned long long" => 8,
        "u32" | "i32" | "int" | "float" | "unsigned" | "unsigned int" => 4,
        "u16" | "i16" | "short" | "unsigned short" => 2,
        "u8" | "char" | "unsigned char" => 1,
        _ => return None,
    })
}

/// The layout of `struct name` in `src` (C rules: each field at its alignment, the size
/// rounded up to the struct's).
pub(crate) fn c_struct(src: &str, name: &str) -> CStruct {
    let src = strip_comments(src);
    let body = struct_body(&src, name);
    let mut fields = Vec::new();
    let (mut at, mut align) = (0usize, struct_align(&src, name));
    for decl in body.split(';').map(str::trim).filter(|d| !d.is_empty()) {
        // `TYPE a, b[N][M]`: the type is everything before the first declarator.
        let first = decl.split(',').next().unwrap_or_default().trim();
        let cut = first
            .rfind(|c: char| c.is_whitespace())
            .unwrap_or_else(|| panic!("{name}: cannot read `{decl}`"));
        let ty = first[..cut].trim();
        let declarators = std::iter::once(&first[cut..]).chain(decl.split(',').skip(1));
        let (elem, elem_align) = match scalar(ty) {
            Some(s) => (s, s),
            None => {
                let inner = c_struct(&src, ty);
                (inner.size, inner.align)
            }
        };
        for d in declarators {
            let d = d.trim();
            let (fname, dims) = d.split_once('[').map_or((d, ""), |(n, rest)| (n, rest));
            let mut count = 1usize;
            for dim in dims.split('[').map(|x| x.trim_end_matches(']').trim()) {
                if dim.is_empty() {
                    continue;
                }
                count *= dim.parse().unwrap_or_else(|_| c_define(&src, dim));
            }
            at = at.div_ceil(elem_align) * elem_align;
            fields.push(Field {
                name: fname.trim().to_string(),
                offset: at,
                size: elem * count,
            });
            at += elem * count;
            align = align.max(elem_align);
        }
    }
    CStruct {
        fields,
        size: at.div_ceil(align) * align,
        align,
    }
}

/// The text between the braces of `struct [__align__(N)] name {`.
fn struct_body<'a>(src: &'a str, name: &str) -> &'a str {
    let start = src
        .match_indices("struct ")
        .map(|(i, _)| i + "struct ".len())
        .find(|&i| {
            let rest = src[i..].trim_start();
            let rest = rest
                .strip_prefix("__align__(")
                .and_then(|r| r.split_once(')'))
                .map_or(rest, |(_, r)| r.trim_start());
            rest.strip_prefix(name)
                .is_some_and(|r| r.trim_start().starts_with('{'))
        })
        .unwrap_or_else(|| panic!("no `struct {name} {{` in the source"));
    let open = start + src[start..].find('{').unwrap_or_default() + 1;
    let close = open
        + src[open..]
            .find('}')
            .unwrap_or_else(|| panic!("struct {name} is not closed"));
    &src[open..close]
}

/// The `__align__(N)` of `struct name`, else 1.
fn struct_align(src: &str, name: &str) -> usize {
    src.match_indices("struct __align__(")
        .find_map(|(i, m)| {
            let rest = &src[i + m.len()..];
            let (n, after) = rest.split_once(')')?;
            after
                .trim_start()
                .strip_prefix(name)
                .filter(|r| r.trim_start().starts_with('{'))
                .and_then(|_| n.trim().parse().ok())
        })
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reader_lays_out_c_structs_as_a_c_compiler_does() {
        let src = "#define N 3\n\
                   struct In { u32 a; u64 b; };  // 16 bytes, 8-aligned\n\
                   struct __align__(16) Out {\n\
                       unsigned char c[N];   // bytes\n\
                       In ins[2][N];\n\
                       float f, g;\n\
                   };";
        let s = c_struct(src, "Out");
        let got: Vec<(String, usize, usize)> = s
            .fields
            .iter()
            .map(|f| (f.name.clone(), f.offset, f.size))
            .collect();
        let want = [("c", 0, 3), ("ins", 8, 96), ("f", 104, 4), ("g", 108, 4)];
        let want: Vec<(String, usize, usize)> = want
            .iter()
            .map(|&(n, o, z)| (n.to_string(), o, z))
            .collect();
        assert_eq!(got, want);
        assert_eq!((s.size, s.align), (112, 16));
        assert_eq!(c_define(src, "N"), 3);
    }

    #[test]
    fn debug_fields_are_the_top_level_names_in_order() {
        #[allow(dead_code)] // read through Debug only
        #[derive(Debug, Default)]
        struct Inner {
            x: [i64; 2],
        }
        #[allow(dead_code)]
        #[derive(Debug, Default)]
        struct Outer {
            a: i64,
            inner: [Inner; 2],
            b_c: (u8, u8),
            z: f64,
        }
        assert_eq!(
            debug_fields(&format!("{:?}", Outer::default())),
            ["a", "inner", "b_c", "z"]
        );
    }
}
