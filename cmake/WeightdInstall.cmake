# Install rules, the exported CMake package, pkg-config, and the .deb
# packages (CPack). Three components, one .deb each, as Debian splits a
# daemon and a library (the worker image needs only the library; a C++
# project's build needs the headers, a running worker does not):
#   daemon  (weightd): weightd, weightctl, the CUDA plugin (when built), the
#           systemd unit, /etc/weightd/weightd.env, profiles, bash
#           completion, manual pages
#   lib     (libweightd-client0.1): libweightd_client.so.0.1
#   dev     (libweightd-client-dev): the public headers (include/weightd/),
#           the .so link, the CMake package (find_package(weightd CONFIG) ->
#           weightd::client) and weightd-client.pc
# `cmake --install build --prefix P` installs all three under P. With the
# prefix /usr (the packages) the unit goes to /lib/systemd/system and the
# configuration to /etc/weightd, as Debian places them; under any other
# prefix both stay inside it (P/lib/systemd/system, P/etc/weightd).
include(CMakePackageConfigHelpers)

set(WEIGHTD_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/weightd)

# ---------------------------------------------------------------- daemon
install(TARGETS weightd weightctl RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT daemon)
if(TARGET weightd_cuda_plugin)
  # Where the daemon looks for it: <bindir>/../lib/weightd (gpu_devices.cc).
  install(TARGETS weightd_cuda_plugin LIBRARY DESTINATION lib/weightd COMPONENT daemon)
endif()
install(DIRECTORY ${CMAKE_SOURCE_DIR}/deploy/profiles/
        DESTINATION ${CMAKE_INSTALL_DATADIR}/weightd/profiles COMPONENT daemon
        FILES_MATCHING PATTERN "*.json")
install(FILES ${CMAKE_SOURCE_DIR}/deploy/completion/weightctl.bash
        DESTINATION ${CMAKE_INSTALL_DATADIR}/bash-completion/completions
        RENAME weightctl COMPONENT daemon)
foreach(prog weightd weightctl)
  if(prog STREQUAL "weightd")
    set(summary "per-node model weight-serving daemon")
    set(see "weightctl(1); README.md and deploy/README.md in the sources")
  else()
    set(summary "command line of the weightd daemon")
    set(see "weightd(1); README.md in the sources")
  endif()
  add_custom_command(
    OUTPUT ${CMAKE_BINARY_DIR}/man/${prog}.1.gz
    COMMAND ${CMAKE_COMMAND} -DEXE=$<TARGET_FILE:${prog}> -DNAME=${prog} "-DSUMMARY=${summary}"
            -DVERSION=${PROJECT_VERSION} "-DSEE_ALSO=${see}" -DOUT=${CMAKE_BINARY_DIR}/man/${prog}.1.gz
            -P ${CMAKE_SOURCE_DIR}/cmake/WeightdManPage.cmake
    DEPENDS ${prog} ${CMAKE_SOURCE_DIR}/cmake/WeightdManPage.cmake
    COMMENT "manual page ${prog}(1)"
    VERBATIM)
  list(APPEND weightd_man_pages ${CMAKE_BINARY_DIR}/man/${prog}.1.gz)
endforeach()
file(MAKE_DIRECTORY ${CMAKE_BINARY_DIR}/man)
add_custom_target(weightd_man_pages ALL DEPENDS ${weightd_man_pages})
install(FILES ${weightd_man_pages} DESTINATION ${CMAKE_INSTALL_MANDIR}/man1 COMPONENT daemon)

# The unit and the configuration: their place depends on the prefix given
# at install time, so it is decided then. file(INSTALL) adds $DESTDIR.
install(CODE "
  if(CMAKE_INSTALL_PREFIX STREQUAL \"/usr\")
    set(_weightd_etc /etc/weightd)
    set(_weightd_unit /lib/systemd/system)
  else()
    set(_weightd_etc \"\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_SYSCONFDIR}/weightd\")
    set(_weightd_unit \"\${CMAKE_INSTALL_PREFIX}/lib/systemd/system\")
  endif()
  # The unit as installed: its manual-install header replaced, the daemon
  # and the settings file where this install puts them.
  file(READ \"${CMAKE_SOURCE_DIR}/deploy/systemd/weightd.service\" _weightd_text)
  string(FIND \"\${_weightd_text}\" \"[Unit]\" _weightd_at)
  string(SUBSTRING \"\${_weightd_text}\" \${_weightd_at} -1 _weightd_text)
  string(REPLACE \"/usr/local/bin/weightd\" \"\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_BINDIR}/weightd\"
         _weightd_text \"\${_weightd_text}\")
  string(REPLACE \"/etc/weightd/weightd.env\" \"\${_weightd_etc}/weightd.env\"
         _weightd_text \"\${_weightd_text}\")
  set(_weightd_text \"# weightd, as installed. Settings: \${_weightd_etc}/weightd.env; the service is
# not enabled on install: systemctl enable --now weightd. See deploy/README.md
# in the sources (workers join group weightd to reach the socket).
\${_weightd_text}\")
  file(WRITE \"${CMAKE_BINARY_DIR}/install/weightd.service\" \"\${_weightd_text}\")
  file(INSTALL DESTINATION \"\${_weightd_unit}\" TYPE FILE
       FILES \"${CMAKE_BINARY_DIR}/install/weightd.service\")
  file(INSTALL DESTINATION \"\${_weightd_etc}\" TYPE FILE
       FILES \"${CMAKE_SOURCE_DIR}/deploy/systemd/weightd.env\")
" COMPONENT daemon)

# Debian's per-package documentation (both components): copyright and the
# changelog, compressed as policy wants it (gzip -9n: no name, no time).
file(MAKE_DIRECTORY ${CMAKE_BINARY_DIR}/install)
execute_process(COMMAND gzip -9nc ${CMAKE_SOURCE_DIR}/deploy/debian/changelog
                OUTPUT_FILE ${CMAKE_BINARY_DIR}/install/changelog.gz COMMAND_ERROR_IS_FATAL ANY)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS
             ${CMAKE_SOURCE_DIR}/deploy/debian/changelog)
foreach(pkg_component weightd:daemon libweightd-client0.1:lib libweightd-client-dev:dev)
  string(REPLACE ":" ";" pc ${pkg_component})
  list(GET pc 0 pkg)
  list(GET pc 1 component)
  install(FILES ${CMAKE_SOURCE_DIR}/deploy/debian/copyright ${CMAKE_BINARY_DIR}/install/changelog.gz
          DESTINATION ${CMAKE_INSTALL_DATADIR}/doc/${pkg} COMPONENT ${component})
endforeach()

# ---------------------------------------------------------------- client
install(TARGETS weightd_client_shared EXPORT weightdTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT lib NAMELINK_COMPONENT dev)
install(FILES ${CMAKE_SOURCE_DIR}/client/weightd_client.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/weightd COMPONENT dev)
install(FILES ${CMAKE_SOURCE_DIR}/common/digest.h ${CMAKE_SOURCE_DIR}/common/dtype.h
              ${CMAKE_SOURCE_DIR}/common/fd.h ${CMAKE_SOURCE_DIR}/common/shard.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/weightd/common COMPONENT dev)
install(EXPORT weightdTargets NAMESPACE weightd:: DESTINATION ${WEIGHTD_CMAKE_DIR}
        COMPONENT dev)
configure_package_config_file(${CMAKE_SOURCE_DIR}/cmake/weightdConfig.cmake.in
  ${CMAKE_BINARY_DIR}/install/weightdConfig.cmake INSTALL_DESTINATION ${WEIGHTD_CMAKE_DIR})
# 0.x: a minor version may change the client's API.
write_basic_package_version_file(${CMAKE_BINARY_DIR}/install/weightdConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/install/weightdConfig.cmake
              ${CMAKE_BINARY_DIR}/install/weightdConfigVersion.cmake
        DESTINATION ${WEIGHTD_CMAKE_DIR} COMPONENT dev)
# pkg-config: prefix relative to the .pc file, so an install under any
# --prefix finds itself.
file(RELATIVE_PATH WEIGHTD_PC_TO_PREFIX
     /prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig /prefix)
configure_file(${CMAKE_SOURCE_DIR}/client/weightd-client.pc.in
               ${CMAKE_BINARY_DIR}/install/weightd-client.pc @ONLY)
install(FILES ${CMAKE_BINARY_DIR}/install/weightd-client.pc
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT dev)

# ---------------------------------------------------------------- .deb
# scripts/package.sh runs cpack on the build; tests/integration/test_packaging.py
# checks what comes out (contents, shlibdeps, lintian, maintainer scripts).
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME weightd)
set(CPACK_PACKAGE_VENDOR "weightd")
set(WEIGHTD_PACKAGE_CONTACT "weightd maintainers <weightd@example.org>" CACHE STRING
    "Maintainer field of the .deb packages")
set(CPACK_PACKAGE_CONTACT "${WEIGHTD_PACKAGE_CONTACT}")
# No CPACK_PACKAGE_DESCRIPTION_SUMMARY: CPack 3.25 would put it before every
# package's description; each description's first line is its synopsis.
# Installed with the prefix /usr under DESTDIR, so the install-time choice
# above puts the unit in /lib/systemd/system and the settings in /etc.
set(CPACK_INSTALL_PREFIX /usr)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_SET_DESTDIR ON)
set(CPACK_STRIP_FILES ON)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_ALL daemon lib dev)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
# Components depending on each other get "(= version)".
set(CPACK_DEBIAN_ENABLE_COMPONENT_DEPENDS ON)

set(CPACK_DEBIAN_DAEMON_PACKAGE_NAME weightd)
set(CPACK_DEBIAN_DAEMON_PACKAGE_SECTION net)
set(CPACK_DEBIAN_DAEMON_PACKAGE_DEPENDS "adduser")
set(CPACK_DEBIAN_DAEMON_DESCRIPTION "per-node model weight-serving daemon
weightd keeps safetensors checkpoints resident in host memory, applies
LoRA adapters and hands every inference rank exactly its shard, cast to
the dtype it asks for, through shared memory, gRPC or CUDA IPC.
This package has the daemon, weightctl and a systemd unit.")
set(CPACK_DEBIAN_DAEMON_PACKAGE_CONTROL_EXTRA
    ${CMAKE_SOURCE_DIR}/deploy/debian/postinst ${CMAKE_SOURCE_DIR}/deploy/debian/postrm
    ${CMAKE_SOURCE_DIR}/deploy/debian/conffiles)
set(CPACK_DEBIAN_DAEMON_PACKAGE_CONTROL_STRICT_PERMISSION ON)

set(CPACK_DEBIAN_LIB_PACKAGE_NAME libweightd-client0.1)
set(CPACK_DEBIAN_LIB_PACKAGE_SECTION libs)
set(CPACK_DEBIAN_LIB_DESCRIPTION "C++ client library of the weightd daemon
libweightd_client.so.0.1: fetch model shards from a weightd daemon over
shared memory, gRPC or CUDA IPC.")
# The shlibs file other packages' dpkg-shlibdeps read, and the ldconfig
# trigger instead of ldconfig calls in maintainer scripts.
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS_POLICY ">=")
set(CPACK_DEBIAN_LIB_PACKAGE_CONTROL_EXTRA ${CMAKE_SOURCE_DIR}/deploy/debian/triggers)

set(CPACK_DEBIAN_DEV_PACKAGE_NAME libweightd-client-dev)
set(CPACK_DEBIAN_DEV_PACKAGE_SECTION libdevel)
set(CPACK_COMPONENT_DEV_DEPENDS lib)
set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS "libabsl-dev")
set(CPACK_DEBIAN_DEV_DESCRIPTION "C++ client library of the weightd daemon (development files)
Headers (include/weightd/), the CMake package (find_package(weightd
CONFIG) gives weightd::client) and the pkg-config file weightd-client.")
include(CPack)
